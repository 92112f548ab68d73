"""The cluster model: seconds per step on GPU nodes t5scale cannot run (`t5scale simulate`)."""

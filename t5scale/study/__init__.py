"""The scaling study: the grid, isolated trials, the funneled search on evidence, the report."""

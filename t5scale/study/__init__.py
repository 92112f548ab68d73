"""The scaling study: grid, isolated trials, funneled search, planner, cluster model, report."""

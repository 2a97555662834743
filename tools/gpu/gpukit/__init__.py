"""The GPU kit's build side: groups, fetching, the travelling tree, cutting and planning."""

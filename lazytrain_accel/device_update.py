"""The chunk the residents' GPU update works in, shared by the optimizer and the planner.

A module of its own, at the top of the package and free of torch: `optim/` runs the update
in chunks of this size, `planning/` sizes the update's device workspace from it, and
planning must import neither torch nor `optim/` (whose `__init__` loads torch). Importing a
`planning/` leaf from `optim/` would run `planning/__init__` (the MIP) instead.
"""

#: Elements per pass of the torch path on a device master (the residents' update on the
#: GPU): whole blocks at a time, so its fp32 temporaries stay ~0.6 GB however large the
#: tensor (an untied 152k x 5120 head would need ~19 GB in one pass). The update is
#: elementwise within a block, so the chunks compute the same bits as one pass.
DEVICE_UPDATE_CHUNK_ELEMENTS = 2**24

"""The training step: the drafter model and its attention, the objective, the loss and optimizer
kernels, and the trainer that runs one step (and, as DrafterSide, builds, resumes and checkpoints it).
Nothing here imports from dflash.step itself.
"""

"""One module per dflashctl verb; each defines `register(app)` and calls one library function."""

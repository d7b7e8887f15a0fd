"""What a job trains on: where its inputs are (inputs.py), the tokenizers (tokenizer.py), records to
token ids and token-budget batches (dataset.py), the target's own responses as data (responses.py),
the built-in demo corpus and tiny target (demo.py), and all of it made ready for a job (prepare.py).
Nothing here imports from dflash.data.dataset itself.
"""

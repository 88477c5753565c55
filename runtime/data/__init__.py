"""The data a run reads: the byte-level token stream over the shipped text (corpus.py), token files
(tokens.py), Hugging Face data sets streamed and tokenized on the fly (hf_data.py), chat templates for --sft
(chat.py) and this rank's share of each step (batches.py); which of them a config's --data names is
tessera.training.data_sources's."""

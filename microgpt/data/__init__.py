"""The data layer: what a run trains on. It depends on microgpt.config, errors and fileio, nothing of the engine.

    experiment.py  the experiment's data/mixing sections -> (train Batches, Validation); tokenizer record; the
                   check that a run's data exist and fit its model (check_data)
    recipe.py      data.prep: the one `microgpt prep --experiment FILE` command that makes an experiment's data
    loader.py      the Batches interface the trainer calls, Validation, and Loader (windows over one shard set)
    mixing.py      FIREHOSE: the online-mixing bandit and the mixture loader (docs/FIREHOSE-BANDIT.md)
    corpus.py      the built-in corpus, defined once (stdlib source + synthetic chats); cache folder
    prep.py        sources -> tokenizer + token shards + manifest (library prepare(), and `microgpt prep`)
    sources.py     reading Hermes-3/ShareGPT/OpenAI records, {"text"} JSONL and plain text into documents
    pull.py        `microgpt pull-hermes3`: the Hermes-3 data set, validated and normalized
    shards.py      llm.c's token-shard format, and loss-mask shards
    tokenizer.py   byte-level BPE with the chat special tokens, and the byte tokenizer
    chatml.py      ChatML rendering and record validation
    hellaswag_file.py  HellaSwag's JSONL examples, checked and tokenized (scored by microgpt/use/hellaswag.py)

The names the trainer and the CLI use are importable from here.
"""

from microgpt.data.experiment import (
    check_data,
    data_description,
    ensure_builtin,
    make_loaders,
    shard_dir,
    tokenizer_info,
    uses_bytes,
    validate,
)
from microgpt.data.loader import Batches, Loader, MicroSchedule, Validation

__all__ = ["Batches", "Loader", "MicroSchedule", "Validation", "check_data", "data_description", "ensure_builtin",
           "make_loaders", "shard_dir", "tokenizer_info", "uses_bytes", "validate"]  # fmt: skip

"""posttrain.data: dataset schemas, chat templates, truncation, tokenized examples and batches."""

from posttrain.data.datasets import (
    DataConfig,
    DataReport,
    PackedExample,
    PreferenceExample,
    PromptExample,
    RankingExample,
    SequenceBatch,
    SFTExample,
    collate,
    collate_packed,
    collate_preferences,
    collate_rankings,
    collate_sft,
    load_preferences,
    load_prompts,
    load_rankings,
    load_sft,
    pack_sft,
)
from posttrain.data.encode import Encoder
from posttrain.data.real import gsm8k_final_answer, load_gsm8k, load_hh_rlhf
from posttrain.data.rows import DataError, NoUsableRows, read_rows

__all__ = [
    "DataConfig",
    "DataError",
    "DataReport",
    "PackedExample",
    "Encoder",
    "NoUsableRows",
    "PreferenceExample",
    "PromptExample",
    "RankingExample",
    "SFTExample",
    "SequenceBatch",
    "collate",
    "collate_packed",
    "collate_preferences",
    "collate_rankings",
    "collate_sft",
    "gsm8k_final_answer",
    "load_gsm8k",
    "load_hh_rlhf",
    "load_preferences",
    "load_prompts",
    "load_rankings",
    "load_sft",
    "pack_sft",
    "read_rows",
]

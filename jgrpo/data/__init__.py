"""Prompt data: local files or built-in tasks -> chat-formatted, tokenized, shuffled, sharded, resumable batches."""

from jgrpo.data.formats import Example
from jgrpo.data.pipeline import PromptBatch, PromptIterator, build_prompt_iterator, load_examples
from jgrpo.data.prompts import PromptEncoder, bucketed_length, chat_prompt_ids, left_pad, pad_id_for
from jgrpo.data.sources import DataSourceError

__all__ = ["DataSourceError", "Example", "PromptBatch", "PromptEncoder", "PromptIterator", "bucketed_length",
           "build_prompt_iterator", "chat_prompt_ids", "left_pad", "load_examples", "pad_id_for"]

"""Training of the embedded `pydoc` model (corpus, tokenizer, recipe); `python -m bench.train` rebuilds it."""
from bench.train.corpus import Corpus, load_corpus
from bench.train.trainer import Recipe, train

__all__ = ["Corpus", "Recipe", "load_corpus", "train"]

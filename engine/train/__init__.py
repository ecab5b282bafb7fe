"""Training of the embedded `pydoc` model (corpus, tokenizer, recipe); `python -m engine.train` rebuilds it."""
from engine.train.corpus import Corpus, load_corpus
from engine.train.trainer import Recipe, train

__all__ = ["Corpus", "Recipe", "load_corpus", "train"]

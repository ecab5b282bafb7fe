"""Shared model runtime: the Llama-family model, paged KV cache, scheduler and colocated Engine."""
from engine.block_manager import BlockManager, prompt_block_hashes
from engine.config import ModelConfig
from engine.engine import Engine
from engine.presets import PRESETS, init_preset, resolve_model
from engine.request import Completion, Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["BlockManager", "Completion", "Engine", "IncrementalDetokenizer", "ModelConfig", "PRESETS",
           "Request", "RequestOutput", "RequestStatus", "SamplingParams", "Tokenizer", "init_preset",
           "prompt_block_hashes", "resolve_model"]

"""Scheduling: which requests run in each step, and the thread that steps the engine.

    request.py     Request (its tokens, block table, status), RequestOutput, Completion
    scheduler.py   Scheduler: continuous batching, chunked prefill, preemption by recompute
    loop.py        EngineLoop: the background thread that owns an engine between steps
"""

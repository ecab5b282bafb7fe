"""What a step's sampled tokens become.

    processor.py   OutputProcessor: append, detokenize, stop (EOS, stop token ids, max_tokens, stop strings)
    events.py      engine outputs as the workers' wire events (worker.proto DecodeEvent)
"""

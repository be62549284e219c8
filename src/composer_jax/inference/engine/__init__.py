"""The sampling engine: everything between a policy's parameters and its completions, with no HTTP,
no checkpoint files and no command line (RL's in-process sampler uses it as the server does).

token_sampling.py       temperature / top-k / top-p sampling from logits (pure, jittable)
counted_jit.py          `CountedJit`: jitted programs that count their XLA compilations
slot_table.py           `Request`, `Completion`, `SlotTable`: requests in slots, emitted tokens
prefix_cache.py         which free slot a prompt takes and the prefix its KV row holds (no JAX)
decode_programs.py      the compiled prefill and decode programs of the plain sampler
draft_verify.py         MTP speculative decoding's pure parts: the drafts and the acceptance rule
speculative_decoder.py  `SpeculativeDecoder`: that state (MTP cache, drafts) and its programs
batch_sampler.py        `Sampler`: continuous batching over KV-cache slots, stepped by one owner
driver.py               `Driver`: the owner's cycle (swaps, submissions, a step) and failure policy
thread_engine.py        `Engine`: a driver in its own thread, fed from any thread (the server's)
asyncio_sampler.py      `AsyncSampler`: a driver stepped from an asyncio task (RL rollouts)
"""

"""The KV cache: what each layer group keeps and how K/V are stored (`spec`), where K/V live (`storage`),
who owns which block (`block_manager`, `manager`), how big the pool is
and what its K/V take per token and per request (`pool`, `sizing`), why a prefix was missed
(`prefix_misses`) and how blocks go to disk (`snapshot`; the disk tier under the prefix cache: `tier`,
`tier_pool`).

Nothing here knows the engine, the model or the tokenizer.
"""

"""The vLLM adapter: position-independent chunk reuse inside vLLM's V1 engine, as a KV connector.

    connector.py   KvposConnector (loaded by module path)
    attention.py   KvposAttentionBackend: raw keys in the paged cache, each request's positions, layout (sequential /
                   parallel) and APE applied in attention (opt-in: KVPOS_VLLM_ATTENTION=1 + engine_kwargs(attention=True))
    attention_cuda.py  KvposFlashBackend: the same over vLLM's FlashAttention (CUDA build; written, not tested in
                   an engine)
    rows.py        the backends' engine-independent half: row views, logical positions, torch attention of a row
    plugin.py      the vllm.general_plugins entry point that registers it (no vllm import at module level)
    paged.py       vLLM's CPU paged-cache block layout: write, gather, block copies, the key view
    flash_layout.py    vLLM's FlashAttention block layout (CUDA): write, gather (no vllm import)
    scheduler.py / worker.py / params.py   the connector's two sides and its strict request parameters
    requests.py    RequestBuilder: token ids + kv_transfer_params of anchor / passages / question requests
    engine.py      engine_kwargs (the LLM arguments with the connector), precompute (fill the store through the
                   engine, batched, with progress)

Import connector, attention, attention_cuda and paged only where vLLM is installed; requests, engine helpers,
rows and flash_layout import no engine and work in any environment.
"""

"""The vLLM adapter: position-independent chunk reuse inside vLLM's V1 engine, as a KV connector.

    connector.py   KvposConnector (loaded by module path)
    attention.py   KvposAttentionBackend: raw keys in the paged cache, each request's positions, layout (sequential /
                   parallel) and APE applied in attention (opt-in: KVPOS_VLLM_ATTENTION=1 + engine_kwargs(attention=True))
    plugin.py      the vllm.general_plugins entry point that registers it (no vllm import at module level)
    paged.py       vLLM's CPU paged-cache block layout: write, gather
    scheduler.py / worker.py / params.py   the connector's two sides and its strict request parameters
    requests.py    RequestBuilder: token ids + kv_transfer_params of anchor / passages / question requests
    engine.py      engine_kwargs (the LLM arguments with the connector), precompute (fill the store through the
                   engine, batched, with progress)

Import connector, attention and paged only where vLLM is installed; requests and engine helpers import no
engine and work in any environment.
"""

"""The vLLM adapter: position-independent chunk reuse inside vLLM's V1 engine, as a KV connector.

    connector.py   KvposConnector (loaded by module path; the only module here that imports vllm)
    requests.py    RequestBuilder: token ids + kv_transfer_params of anchor / passages / question requests
    engine.py      engine_kwargs (the LLM arguments with the connector), precompute (fill the store through the
                   engine, batched, with progress)

Import `kvpos.integrations.vllm.connector` only where vLLM is installed; requests and engine helpers import no
engine and work in any environment.
"""

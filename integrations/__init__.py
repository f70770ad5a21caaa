"""kvpos integrations (installed as kvpos.integrations): transformers adapter (hf), RAG adapter (rag)."""

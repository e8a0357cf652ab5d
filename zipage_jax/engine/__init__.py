"""The engine: the step loop (LLMEngine), the offline LLM, the asynchronous front of the server, outputs."""

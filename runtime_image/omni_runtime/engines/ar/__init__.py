"""The `ar` engine family: autoregressive stages on vLLM.

- `engine`: `AREngine`, one vLLM `AsyncLLM` per stage, streaming token deltas per request.
- `tools`: tool-call parsing of a stage's output; `extras`: tokenize/detokenize, logprob rows, structured outputs.
- `hidden_states`: the hidden-state rows a running request streams to its talker.
- `vllm_plugins`: what vLLM loads in each of its processes (entry point `vllm.general_plugins`);
  `qwen2_5_omni_eagle`: the Qwen2.5-Omni thinker wrapper it registers.

Importing this package imports no vLLM: the factory imports `engine` by name when an AR stage starts.
"""

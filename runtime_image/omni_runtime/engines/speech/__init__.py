"""Speech-output stages of the Qwen omni models: the talker's decode loop and codec-to-waveform decoding.

- `weights`: load one part (talker, code2wav, the thinker's embedding table) of a whole-model checkpoint.
- `talker`: `Qwen3TalkerEngine`, step-batched decoding of codec frames from the thinker's tokens.
- `code2wav`: `Code2WavEngine`, windowed decoding of codec frames into a waveform.
- `token2wav`: `Token2WavEngine`, Qwen2.5-Omni's DiT + BigVGAN decoder, whole output per request.
"""

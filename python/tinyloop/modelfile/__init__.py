"""The `.tinyloop` model file and its tools: read and write the file (`format`, `vocab`), quantize it (`quants`,
`gptq`, `calibrate`, `quantize`), give it a draft vocabulary (`draft_vocab`), export it for llama.cpp
(`export_llama`) and measure a model (`evaluate`). The engine reads the file in Rust; these are the Python side
(docs/format.md describes the file)."""

"""HTTP serving: SGLang-compatible native API, OpenAI API, flowlang's remote protocol."""

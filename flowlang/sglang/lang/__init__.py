"""SGLang's `sglang.lang` package paths, so `from sglang.lang.ir import REGEX_INT` (and the
other names SGLang programs import from `sglang.lang.*`) reads `from flowlang.sglang.lang.ir
import REGEX_INT`. The objects are flowlang.sglang's own."""

"""Request bodies that account for every field a client may send, so nothing is dropped
without saying so. Each declared field is one of three kinds:
- honoured: typed and mapped onto the engine;
- ignored: a server-side knob with no meaning for one text-only engine (routing, metrics,
  tracing, billing metadata); it has no effect, and a request that sets one says so in the
  server's log;
- unsupported: a feature flowlang does not have; accepted unset (null, false, empty),
  otherwise a 400 that names it.
A field the API does not know is a 422 that names it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import InvalidRequestError


def ignored_field(reason: str, default: Any = None) -> Any:
    """A field that has no meaning here: accepted, no effect, logged."""
    return Field(default, description=f"ignored: {reason}", json_schema_extra={"kind": "ignored"})


def unsupported_field(reason: str, default: Any = None) -> Any:
    """A field for a feature flowlang lacks: accepted unset, otherwise a 400 naming it."""
    return Field(
        default, description=f"not supported: {reason}", json_schema_extra={"kind": "unsupported"}
    )


class AuditedFields(BaseModel):
    """A body of honoured, ignored and unsupported fields; unknown ones are a 422."""

    model_config = ConfigDict(extra="forbid")
    api_name: ClassVar[str] = "API"

    def fields_of_kind(self, kind: str) -> list[str]:
        """Fields of `kind` ("ignored" or "unsupported") this request sets (unset: default,
        null or empty)."""
        found = []
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra or {}
            value = getattr(self, name)
            if extra.get("kind") == kind and value not in (info.default, None, [], {}, ""):
                found.append(name)
        return found

    def check_supported(self, where: str = "") -> None:
        """Refuse (400) a request that sets a feature flowlang does not have."""
        given = self.fields_of_kind("unsupported")
        if given:
            fields = type(self).model_fields
            reasons = "; ".join(f"{where}{n}: {fields[n].description}" for n in given)
            raise InvalidRequestError(f"unsupported {self.api_name} fields: {reasons}")

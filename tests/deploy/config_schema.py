"""The `config` part of the chart's values.schema.json, derived from the agent's settings model.

`config` in values.yaml is mirrored into agent.yaml, so its schema is the settings model's:
pydantic's JSON schema with references inlined, titles dropped, and draft-7 spellings. The
region pattern and the required zone are added here (the model has defaults for both; a
deployment must name its own). Regenerate after a settings change:

    .venv/bin/python -m tests.deploy.config_schema --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from region_agent.app.settings import AgentSettings
from region_agent.base.names import REGION_PATTERN

SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "region-agent" / "values.schema.json"
ZONE_PATTERN = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}\.?$"


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[1]]
            merged = {**_inline(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
            return _inline(merged, defs)
        out = {k: _inline(v, defs) for k, v in node.items() if k not in ("title", "$defs", "default")}
        if out.get("type") == "object" and "properties" in out:
            out["additionalProperties"] = False
            out.pop("required", None)  # every field has a default; what a deployment must set is added below
        return out
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


def config_schema() -> dict[str, Any]:
    raw = AgentSettings.model_json_schema(mode="validation")
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    schema.pop("description", None)
    schema["description"] = "The agent's settings, mirrored into agent.yaml (region_agent.app.settings.AgentSettings)."
    props = schema["properties"]
    props["region"] = {**props["region"], "pattern": REGION_PATTERN.pattern}
    props["dns"]["properties"]["zone"] = {**props["dns"]["properties"]["zone"], "pattern": ZONE_PATTERN}
    props["dns"]["required"] = ["zone"]
    schema["required"] = ["region", "dns"]
    return schema


def main() -> int:
    document = json.loads(SCHEMA.read_text())
    fresh = config_schema()
    if "--write" in sys.argv:
        document["properties"]["config"] = fresh
        SCHEMA.write_text(json.dumps(document, indent=2) + "\n")
        return 0
    return 0 if document["properties"]["config"] == fresh else 1


if __name__ == "__main__":
    raise SystemExit(main())

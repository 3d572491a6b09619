"""The protos document themselves, and the generated code in the repo matches them
(regenerate with `make protos`)."""

import re

from specdec import protogen

DECLARATION = re.compile(r"^\s*((message|enum|service|rpc)\s|[^/\s].*=\s*\d+;)")


def test_generated_code_is_current(tmp_path):
    generated = protogen.generate(tmp_path)
    assert len(generated) == 3 * len(protogen.proto_files()) >= 12
    for fresh in generated:
        committed = protogen.ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run make protos"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run make protos"


def test_every_declaration_has_a_comment():
    undocumented = []
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if DECLARATION.match(line) and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {line.strip()}")
    assert not undocumented, "\n".join(undocumented)

"""`specdec bench paths`: every engine it compares runs the path its line names."""

import json

from deploy.bench import paths


def test_each_line_names_the_path_its_engine_took(tmp_path):
    args = paths.build_parser().parse_args(["--families", "qwen2", "--methods", "q4_0", "--rounds", "1",
                                            "--out", str(tmp_path)])
    assert paths.main_with(args) == 0
    lines = json.loads((tmp_path / "paths.json").read_text())["lines"][1:]
    numerics = [line.split(" -> ")[1].split(":")[0] for line in lines]
    assert numerics == ["gguf/float32/cpu/layer-kernel", "q4_0/float32/cpu/layer-kernel",
                        "q8_m/float32/cpu/layer-kernel", "int8/float32/cpu/llama",
                        "int8/float32/cpu/llama", "q8_m/float32/cpu/layer-kernel"]
    assert all("ms (" in line for line in lines)

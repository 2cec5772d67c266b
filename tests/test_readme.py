"""The README's Python examples run as written and print what it says."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_every_python_block_of_the_readme_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    outputs = []
    for block in blocks:
        r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                           timeout=300, env=None)
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout)
    assert "[11. 11. 11. 11.]" in outputs[0]
    assert "True False None" in outputs[1]
    assert "['eager', 'replay'] True" in outputs[2]
    assert any(o == "1.0\n[1.0, 1.0] ['ServerForked']\n" for o in outputs)     # fork
    # Graphs that change (docs/contract.md section 4b)
    assert any("{'alpha': 1.0, 'n': 4}\n[10. 11. 12. 13.]\n[10. 11. 12. 13.]\nGraph " in o
               for o in outputs)
    assert any("[3. 3. 3. 3.]\n[8. 8. 8. 8.]" in o for o in outputs)
    assert any(o == "5376 4096\n[3. 3.] True\n" for o in outputs)            # graph pools

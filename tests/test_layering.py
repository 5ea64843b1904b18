"""The I/O-free core imports no asyncio, websockets, torch or funasr."""

import subprocess
import sys

CORE = ["framing", "segmenter", "session", "protocol", "transcript", "jobs", "resample"]


def test_core_modules_import_no_io_or_model_libraries():
    code = (
        "import sys\n"
        + "".join(f"import streamer.{m}\n" for m in CORE)
        + "bad = [m for m in ('asyncio', 'websockets', 'torch', 'funasr') if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_help_does_not_import_torch():
    code = (
        "import sys\nfrom streamer.cli import build_parser\nbuild_parser()\n"
        "print('torch' in sys.modules or 'funasr' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""`{cli-help} module`: the `--help` of a command-line module, run at build time, as a literal block."""

import subprocess
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


class CliHelp(SphinxDirective):
    """Runs `python -m MODULE --help` and shows its output; a non-zero exit fails the build."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True,
                             env={"COLUMNS": "100", "PATH": "", "JAX_PLATFORMS": "cpu"}).stdout
        return [nodes.literal_block(out, out, language="text")]


def setup(app):  # noqa: D103
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True}

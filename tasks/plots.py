"""Pictures for the UI's artifacts: matplotlib figures drawn off-screen, as PNG bytes and as an
image a Markdown artifact embeds. matplotlib is imported on first use: the CLI and the workers
that draw nothing never load it."""

import base64
import io


def pyplot():
    """matplotlib's pyplot, on the off-screen Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """The figure laid out and saved as PNG; the figure is closed."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    pyplot().close(fig)
    return buffer.getvalue()


def markdown_image(alt: str, image: bytes) -> str:
    """A PNG embedded in Markdown (a Prefect artifact shows it as it is, with no file to serve)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(image).decode()})"

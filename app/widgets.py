"""The chat's widgets: messages, the accepted-block view, the stats bar and the help screen."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Input, Markdown, Static
from textual.widgets.markdown import MarkdownStream

SPARK = "▁▂▃▄▅▆▇█"

# (key, what it does): the help screen and the README list these.
KEYS = [
    ("enter", "send the message"),
    ("esc", "stop the answer (the partial answer is kept)"),
    ("ctrl+t", "switch PTP / AR decoding for the next answer"),
    ("ctrl+g", "switch exact / lenient acceptance (lenient: faster, not the model's exact sample)"),
    ("ctrl+b", "show accepted blocks (one shade per model call)"),
    ("ctrl+y", "copy the last answer to the clipboard"),
    ("ctrl+l", "new chat (the open one stays in the list)"),
    ("ctrl+o", "saved chats of this model: enter reopens, d deletes"),
    ("f1", "this help"),
    ("ctrl+q", "quit"),
]


def sparkline(histogram: dict[int, int]) -> str:
    """Bars for tokens-per-call 1..max, e.g. ``1▕▂█▅▁▏4``; empty when there is no data."""
    if not histogram:
        return ""
    top = max(histogram)
    peak = max(histogram.values())
    bars = "".join(
        SPARK[min(len(SPARK) - 1, round((len(SPARK) - 1) * histogram[k] / peak))] if histogram.get(k) else " "
        for k in range(1, top + 1)
    )
    return f"1▕{bars}▏{top}"


def split_blocks(text: str, lengths: list[int] | None) -> list[str]:
    """Cut ``text`` into blocks of the given character lengths (one block when they do not add up)."""
    if not lengths or sum(lengths) != len(text):
        return [text] if text else []
    out, pos = [], 0
    for n in lengths:
        out.append(text[pos : pos + n])
        pos += n
    return out


class UserMessage(Static):
    """What the user sent."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="user")
        self.text = text


class BlocksView(Widget):
    """The answer as plain text with alternating shading per accepted block."""

    COMPONENT_CLASSES = {"blocks--even", "blocks--odd"}
    DEFAULT_CSS = """
    BlocksView { height: auto; }
    BlocksView > .blocks--even { background: $primary 25%; }
    BlocksView > .blocks--odd { background: $warning 25%; }
    """

    def __init__(self, blocks: list[str]) -> None:
        super().__init__()
        self.blocks = blocks

    def render(self) -> Text:
        even = self.get_component_rich_style("blocks--even")
        odd = self.get_component_rich_style("blocks--odd")
        text = Text()
        for i, block in enumerate(self.blocks):
            text.append(block, style=odd if i % 2 else even)
        return text


class AnswerView(Vertical):
    """One answer: a header (mode, counts), the Markdown view and the block view (shown by ctrl+b)."""

    def __init__(
        self,
        mode: str,
        blocks: list[str] | None = None,
        stopped: bool = False,
        finished: bool = False,
        sizes: list[int] | None = None,
        note: str = "",
    ) -> None:
        """A live answer (``AnswerView(mode)``) or a restored one: its blocks, tokens decided per call
        (``sizes``), stop and note as saved, so its header reads as it did live."""
        super().__init__(classes="answer")
        self.mode = mode
        self.blocks: list[str] = list(blocks or [])
        self.sizes: list[int] = list(sizes or [])  # tokens decided per model call (accepted drafts + 1)
        self.sources: dict[str, int] = {}  # accepted drafts by who proposed them
        self.stopped = stopped
        self.finished = finished
        self.note = note
        self._stream: MarkdownStream | None = None

    @property
    def tokens(self) -> int:
        return sum(self.sizes)

    @property
    def calls(self) -> int:
        return len(self.sizes)

    @property
    def text(self) -> str:
        return "".join(self.blocks)

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="answer-header")
        yield Markdown(self.text if self.finished else "")
        yield BlocksView(self.blocks)

    def _header(self) -> str:
        parts = [self.mode.upper()]
        if self.calls:  # (answers saved by earlier versions have no counts: the mode alone)
            parts.append(f"{self.tokens} tokens in {self.calls} calls")
        if not self.finished:
            parts.append("answering…")
        if self.stopped:
            parts.append("stopped")
        if self.note:
            parts.append(self.note)
        return " · ".join(parts)

    async def add_block(self, text: str, tokens: int, source: str | None = None) -> None:
        """Show one accepted block (``tokens`` decided by its call, drafts from ``source``): appended to the
        Markdown (streamed) and to the block view."""
        self.blocks.append(text)
        self.sizes.append(tokens)
        if source and tokens > 1:
            self.sources[source] = self.sources.get(source, 0) + tokens - 1
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)
        self.query_one(BlocksView).refresh(layout=True)
        self.query_one(".answer-header", Static).update(self._header())

    async def finish(self, stopped: bool, note: str = "") -> None:
        """Flush the Markdown stream and mark the answer done."""
        self.finished = True
        self.stopped = stopped
        self.note = note
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.query_one(".answer-header", Static).update(self._header())


class StatsBar(Static):
    """Mode, sampling settings, speed and the accepted-length histogram."""

    def show(
        self,
        mode: str,
        settings: str,
        tps: float | None,
        mean: float | None,
        histogram: dict[int, int],
        sources: dict[str, int] | None = None,
        slow_blas: bool = False,
    ) -> None:
        """The most telling figures first, so a narrow terminal cuts the settings, not the speed. ``sources``:
        accepted drafts by who proposed them (shown once prompt lookup has landed some). ``slow_blas``: MLX
        runs on its reference BLAS (Linux), which is why PTP rarely drafts; said here for as long as it lasts."""
        parts = [
            mode.upper(),
            f"{tps:.1f} tok/s" if tps is not None else "– tok/s",
            f"{mean:.2f} tok/call" if mean is not None else "– tok/call",
        ]
        if slow_blas:
            parts.append("SLOW BLAS: pip install mkl")
        spark = sparkline(histogram)
        if spark:
            parts.append(f"tokens/call {spark}")
        if sources and sources.get("lookup"):
            parts.append("drafts " + " ".join(f"{k} {v}" for k, v in sorted(sources.items())))
        parts.append(settings)
        self.update(" │ ".join(parts))


class HelpScreen(ModalScreen[None]):
    """Lists the keys."""

    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close help")]

    def compose(self) -> ComposeResult:
        lines = ["# ptp-chat keys", "", "| key | action |", "|---|---|"]
        lines += [f"| `{k}` | {what} |" for k, what in KEYS]
        lines += [
            "",
            "Each model call accepts a block of tokens; in PTP mode a block can hold several.",
            "",
            "Press esc to close.",
        ]
        with VerticalScroll(id="help"):  # (scrolls with the arrow keys where the window is shorter than the keys)
            yield Markdown("\n".join(lines))


class PromptInput(Input):
    """The prompt line. A paste of several lines is kept whole, its lines joined by single spaces (Textual's
    ``Input`` keeps only a paste's first line: the rest, and a question at its end, were dropped unsaid)."""

    def _on_paste(self, event: events.Paste) -> None:
        lines = [line.strip() for line in event.text.splitlines()]
        if len(lines) < 2:
            return  # (Textual then runs ``Input``'s own handler: one line as it is)
        event.prevent_default()  # (``Input``'s handler, which would add the first line again, is skipped)
        text = " ".join(line for line in lines if line)
        if self.selection.is_empty:
            self.insert_text_at_cursor(text)
        else:
            self.replace(text, *self.selection)
        self.notify(f"pasted {len(lines)} lines as one (the prompt is a single line)")
        event.stop()

"""The chat app: sends the conversation to the engine thread and streams its accepted blocks."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from ptp_mlx import blas
from ptp_mlx.decode.accept import EXACT, SUGGESTED, AcceptRule

from .conversations import ConversationsScreen
from .engine_thread import (
    AnswerFailed,
    AnswerFinished,
    BlockGenerated,
    ChatRequest,
    EngineFailed,
    EngineReady,
    EngineStatus,
    EngineThread,
    GenSettings,
    Loader,
)
from .history import Conversation, ConversationStore, store_for_model
from .widgets import AnswerView, HelpScreen, PromptInput, StatsBar, UserMessage, split_blocks


class ChatApp(App[None]):
    """``ptp-chat``. ``loader`` builds the engine inside the engine thread (a fake one in tests); ``store``: the
    model's saved chats (default: the default model's)."""

    CSS_PATH = "chat.tcss"
    TITLE = "ptp-chat"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+t", "toggle_mode", "PTP/AR"),
        Binding("ctrl+g", "toggle_accept", "Exact/lenient", show=False),
        Binding("ctrl+b", "toggle_blocks", "Blocks"),
        Binding("ctrl+y", "copy_answer", "Copy"),
        Binding("ctrl+l", "new_chat", "New chat"),
        Binding("ctrl+o", "conversations", "Chats"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        loader: Loader,
        settings: GenSettings | None = None,
        mode: str | None = None,
        store: ConversationStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        system: str | None = None,
        accept: AcceptRule | None = None,
        lenient: AcceptRule | None = None,
    ) -> None:
        super().__init__()
        self.system = system  # system prompt put before every conversation sent to the model
        self.loader = loader
        self.settings = settings or GenSettings()
        self.requested_mode = mode
        self.mode = mode or "ar"
        self.accept: AcceptRule = accept or EXACT  # ctrl+g: lenient acceptance (not the exact sample), for PTP answers
        # The lenient rule ctrl+g switches to: ``accept`` if lenient (``ptp-chat --accept``), else the suggested one.
        self.lenient = lenient or (self.accept if self.accept.lenient else AcceptRule.parse(SUGGESTED))
        self.current_accept: AcceptRule = EXACT  # the rule of the answer in progress
        self.store = store or store_for_model(None)
        self.history: Conversation = self.store.new()  # the open chat; the newest saved one once mounted
        self.clock = clock
        self.ready = False
        self.has_adapter = False
        self.load_error: str | None = None
        self.engine_thread: EngineThread | None = None
        self.current: ChatRequest | None = None
        self.answer: AnswerView | None = None
        self.histogram: Counter[int] = Counter()  # tokens per call -> calls, in the open chat
        self.sources: Counter[str] = Counter()  # accepted drafts by who proposed them ("ptp", "lookup"), open chat
        self._live: tuple[float | None, float | None] = (None, None)  # tok/s, tokens/call of the last answer
        self._next_id = 0
        self._status_text = "starting"
        self._load_started = 0.0

    # ----- layout and start-up -----

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield VerticalScroll(id="chat")
        yield Static("", id="status")
        yield PromptInput(placeholder="Ask something (enter sends, esc stops, f1 help)", id="prompt")
        yield StatsBar(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#chat", VerticalScroll).anchor()
        saved = self._saved_chats()
        if saved:  # the chat goes on where it was left
            await self._show(saved[0])
        self.query_one("#prompt", Input).focus()
        self._refresh_stats()
        # The model loads in the engine thread, so the screen is up at once and shows progress.
        self._load_started = self.clock()
        self._set_status("loading the model …")
        self._ticker = self.set_interval(1.0, self._tick)
        # Progress that the loader prints (tqdm bars of the first-run conversion) lands in the status line.
        self.begin_capture_print(self, stdout=True, stderr=True)
        self.engine_thread = EngineThread(self.loader, self.post_message)
        self.engine_thread.start()

    def _tick(self) -> None:
        if self.ready or self.load_error:
            self._ticker.stop()
            return
        self._set_status(self._status_text)

    def _set_status(self, text: str) -> None:
        self._status_text = text
        if not self.ready and not self.load_error:
            text = f"{self.clock() - self._load_started:.0f} s · {text}"
        self.query_one("#status", Static).update(text)

    def _refresh_stats(self) -> None:
        tps, mean = self._live
        mode = self.mode if self.ready else (self.requested_mode or "…")  # undecided until the adapter is known
        if mode == "ptp" and self.accept.lenient:
            mode = "ptp lenient"  # labelled wherever it shows: these answers are not the model's exact sample
        self.query_one(StatsBar).show(
            mode, self.settings.describe(), tps, mean, dict(self.histogram), dict(self.sources), blas.is_slow()
        )

    async def action_quit(self) -> None:
        """Quit; an answer in progress is stopped and saved like Esc does."""
        await self.action_stop()
        self.exit()

    async def on_unmount(self) -> None:
        self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        if self.engine_thread is not None:
            self.engine_thread.shutdown()
            self.engine_thread = None

    # ----- engine messages -----

    def on_print(self, event: events.Print) -> None:
        if self.ready or self.load_error:
            return
        pieces = [p.strip() for p in re.split(r"[\r\n]", event.text) if p.strip()]
        if pieces:
            self._set_status(pieces[-1])

    def on_engine_status(self, msg: EngineStatus) -> None:
        self._set_status(msg.text)

    def on_engine_ready(self, msg: EngineReady) -> None:
        self.ready = True
        self.end_capture_print(self)
        self.has_adapter = msg.has_adapter
        self.mode = self.requested_mode or msg.default_mode
        if self.mode == "ptp" and not self.has_adapter:
            self.mode = "ar"
            self.notify("no PTP adapter for this model: answering in AR mode", severity="warning")
        self.sub_title = msg.description
        self._set_status(f"ready · {msg.description}")
        self._refresh_stats()

    def on_engine_failed(self, msg: EngineFailed) -> None:
        self.load_error = msg.error
        self.end_capture_print(self)
        self._set_status(f"no model loaded: {msg.error}")
        self.notify(msg.error, title="could not load the model", severity="error", timeout=30)

    async def on_block_generated(self, msg: BlockGenerated) -> None:
        if self.current is None or msg.request_id != self.current.request_id or self.answer is None:
            return  # a block of an answer already stopped: dropped
        step = msg.step
        # Tokens per call: accepted drafts + the exact token (1 in AR mode). The header and the stats bar both
        # count these, so an end-of-answer token counts in both although it is not shown.
        decided = step.accepted + 1
        source = getattr(step, "source", None)
        await self.answer.add_block(step.text, decided, source)
        self.histogram[decided] += 1
        if source and step.accepted:
            self.sources[source] += step.accepted
        tps = step.generated / step.elapsed if step.elapsed > 0 else None
        self._live = (tps, self.answer.tokens / self.answer.calls)
        self._refresh_stats()

    async def on_answer_finished(self, msg: AnswerFinished) -> None:
        if self.current is None or msg.request_id != self.current.request_id:
            return
        note = "max tokens" if msg.finish_reason == "length" else ""
        await self._finish_answer(stopped=msg.stopped, note=note)

    async def on_answer_failed(self, msg: AnswerFailed) -> None:
        self.notify(msg.error, title="generation failed", severity="error", timeout=15)
        if self.current is None or msg.request_id != self.current.request_id or self.answer is None:
            return
        if self.answer.blocks:
            await self._finish_answer(stopped=True, note="error")
            return
        # Nothing was generated: take the question back into the input box so it can be edited or resent.
        chat = self.query_one("#chat", VerticalScroll)
        await self.answer.remove()
        if chat.children and isinstance(chat.children[-1], UserMessage):
            await chat.children[-1].remove()
        text = self.history.pop_user()
        self.current = self.answer = None
        prompt = self.query_one("#prompt", Input)
        if text and not prompt.value:
            prompt.value = text
        self._set_status(f"ready · {self.sub_title}")

    async def _finish_answer(self, stopped: bool, note: str = "") -> None:
        answer, self.answer, self.current = self.answer, None, None
        if answer is None:
            return
        if answer.mode == "ptp" and self.current_accept.lenient:
            note = "; ".join(x for x in (f"{self.current_accept.label}: not the exact sample", note) if x)
        await answer.finish(stopped, note)
        # Saved with what its header and the stats bar show, so a reopened chat reads as it did live.
        self.history.add_answer(
            answer.text,
            answer.mode,
            [len(b) for b in answer.blocks],
            stopped,
            calls=answer.sizes,
            sources=answer.sources,
            tps=self._live[0],
            note=note,
        )
        self._save()
        self._set_status("stopped · the partial answer is kept" if stopped else f"ready · {self.sub_title}")

    def _save(self) -> None:
        try:
            self.store.save(self.history)
        except OSError as e:
            self.notify(f"could not save the chat: {e}", severity="warning")

    # ----- user input and keys -----

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.load_error:
            self.notify(f"no model loaded: {self.load_error}", severity="error")
            return
        if not self.ready:
            self.notify("the model is still loading; your message stays in the box", severity="warning")
            return
        if self.current is not None:
            self.notify("still answering: press esc to stop first", severity="warning")
            return
        event.input.value = ""
        chat = self.query_one("#chat", VerticalScroll)
        self.history.add_user(text)
        self.answer = AnswerView(self.mode)
        await chat.mount_all([UserMessage(text), self.answer])
        self._next_id += 1
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = system + self.history.messages()
        self.current_accept = self.accept
        self.current = ChatRequest(
            self._next_id, messages, self.mode, self.settings, self.history.id, accept=self.accept
        )
        self._live = (None, None)
        self._set_status("answering … (esc stops)")
        assert self.engine_thread is not None
        self.engine_thread.submit(self.current)

    async def action_stop(self) -> None:
        """Esc: stop at once; the engine thread drops whatever it computes after this."""
        if self.current is None:
            return
        self.current.stop.set()
        await self._finish_answer(stopped=True)

    def action_toggle_mode(self) -> None:
        if not self.ready:
            self.notify("the model is still loading", severity="warning")
            return
        if self.mode == "ar" and not self.has_adapter:
            self.notify("PTP needs an adapter and this model has none (start with --adapter DIR)", severity="warning")
            return
        self.mode = "ar" if self.mode == "ptp" else "ptp"
        self.notify(f"the next answer uses {self.mode.upper()} decoding")
        self._refresh_stats()

    def action_toggle_accept(self) -> None:
        """ctrl+g: exact acceptance (the model's exact sample) or the lenient rule for the next answers."""
        if not self.accept.lenient and self.ready and not self.has_adapter:  # (it used to say "in PTP mode: ctrl+t")
            self.notify(
                "lenient acceptance is PTP's, which needs an adapter (start with --adapter DIR)", severity="warning"
            )
            return
        self.accept = EXACT if self.accept.lenient else self.lenient
        if self.accept.lenient:
            where = "" if self.mode == "ptp" else " (in PTP mode: ctrl+t)"
            self.notify(f"lenient acceptance{where}: faster, but answers are not the model's exact sample")
        else:
            self.notify("exact acceptance: answers are the model's exact sample")
        self._refresh_stats()

    def action_toggle_blocks(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        chat.toggle_class("show-blocks")
        on = chat.has_class("show-blocks")
        self.notify("showing accepted blocks: one shade per model call" if on else "showing rendered Markdown")

    def action_copy_answer(self) -> None:
        text = self.history.last_answer()
        if not text:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"copied the last answer ({len(text)} characters)")

    async def action_new_chat(self) -> None:
        """Start a new chat; the open one (with an answer in progress stopped and kept) stays in the list."""
        await self.action_stop()
        await self._show(self.store.new())
        self._set_status(f"new chat · {self.sub_title}" if self.ready else self._status_text)
        self.notify("new chat · the previous one is kept (ctrl+o lists them)")

    async def action_conversations(self) -> None:
        """Ctrl+o: the saved chats of this model, to reopen or delete."""
        if isinstance(self.screen, ConversationsScreen):
            return
        self.push_screen(ConversationsScreen(self._saved_chats(), self.history.id, self.delete_chat), self._reopen)

    async def _reopen(self, cid: str | None) -> None:
        if cid is None or cid == self.history.id:
            return
        conv = next((c for c in self._saved_chats() if c.id == cid), None)
        if conv is None:
            self.notify("that chat is gone (deleted, or its file could not be read)", severity="warning")
            return
        await self.action_stop()
        await self._show(conv)
        self._set_status(f"reopened · {self.sub_title}" if self.ready else self._status_text)

    async def delete_chat(self, cid: str) -> str:
        """Delete a saved chat; deleting the open one starts a new chat. Returns the open chat's id."""
        if cid == self.history.id:
            await self.action_stop()  # (it saves the partial answer: the file goes next)
            await self._show(self.store.new())
        try:
            self.store.delete(cid)
        except OSError as e:
            self.notify(f"could not delete the chat: {e}", severity="warning")
        else:
            self.notify("chat deleted")
        return self.history.id

    def _saved_chats(self) -> list[Conversation]:
        chats, warnings = self.store.list()
        for warning in warnings:
            self.notify(warning, title="saved chats", severity="warning", timeout=15)
        return chats

    async def _show(self, conv: Conversation) -> None:
        """Make ``conv`` the open chat: its turns on screen (answers as they looked live) and its stats."""
        chat = self.query_one("#chat", VerticalScroll)
        await chat.remove_children()
        self.history = conv
        self.histogram.clear()
        self.sources.clear()
        self._live = (None, None)
        widgets = []
        for turn in conv.turns:
            if turn["role"] == "user":
                widgets.append(UserMessage(turn["content"]))
                continue
            # (the store hands over turns with every field present and of its type)
            blocks = split_blocks(turn["content"], turn["blocks"])
            view = AnswerView(turn["mode"], blocks, turn["stopped"], True, turn["calls"], turn["note"])
            widgets.append(view)
            self.histogram.update(view.sizes)
            self.sources.update(turn["sources"])
            self._live = (turn["tps"], view.tokens / view.calls if view.calls else None)
        if widgets:
            await chat.mount_all(widgets)
        self._refresh_stats()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

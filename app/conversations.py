"""The list of saved chats (ctrl+o): enter reopens one, d deletes one."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from .history import Conversation


def describe(conv: Conversation, current: bool) -> str:
    """One line of the list: a mark for the open chat, its title, its size and when it last changed."""
    questions = sum(t["role"] == "user" for t in conv.turns)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated)) if conv.updated else "–"
    mark = "● " if current else "  "
    title = conv.title or "(new chat, nothing asked yet)"
    return f"{mark}{title}  ·  {questions} question{'s' if questions != 1 else ''} · {when}"


class ConversationsScreen(ModalScreen[str | None]):
    """Dismissed with the id of the chat to reopen, or None. Deleting goes through ``delete`` (the app's, so
    that deleting the open chat starts a new one; it returns the id of the chat open afterwards) and leaves the
    list open."""

    BINDINGS = [
        Binding("escape,ctrl+o", "dismiss(None)", "Close"),
        Binding("d,delete", "delete", "Delete"),
    ]

    def __init__(
        self,
        conversations: list[Conversation],
        current_id: str,
        delete: Callable[[str], Awaitable[str]],
    ) -> None:
        super().__init__()
        self.conversations = list(conversations)
        self.current_id = current_id
        self._delete = delete

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations"):
            yield Static("Saved chats of this model · enter reopens · d deletes · esc closes", id="conversations-help")
            yield OptionList(id="conversation-list")

    def on_mount(self) -> None:
        self._fill()

    def _fill(self, highlight: int = 0) -> None:
        options = self.query_one(OptionList)
        options.clear_options()
        if not self.conversations:
            options.add_option(Option("no saved chats yet", id="", disabled=True))
            return
        options.add_options(Option(describe(c, c.id == self.current_id), id=c.id) for c in self.conversations)
        options.highlighted = min(highlight, len(self.conversations) - 1)
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self.dismiss(event.option.id)

    async def action_delete(self) -> None:
        """Delete the highlighted chat (its file goes; the list stays open on the next one)."""
        options = self.query_one(OptionList)
        index = options.highlighted
        if index is None or not self.conversations:
            return
        conv = self.conversations.pop(index)
        self.current_id = await self._delete(conv.id)  # (deleting the open chat opens a new one)
        self._fill(index)

"""What every live display on stderr is drawn on: a transient Rich live area that steps aside for stdout
(``LiveArea``, ``DrawnOnLiveArea``), and how a display writes a duration."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console, RenderableType
from rich.live import Live


def format_seconds(seconds: float) -> str:
    """``5.25`` -> ``5.2 s``; ``125`` -> ``2m05s``; ``3725`` -> ``1h02m05s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s"


class LiveArea:
    """A transient live area on a terminal console, drawing ``render()``; ``paused()`` takes it off the screen.

    Each start is a new ``rich.live.Live``. A Live that is stopped and started again positions its
    cursor for the lines it drew before the pause, so its first redraw would erase the last lines
    written in the meantime (the summary, on stdout, when both go to one terminal).
    """

    def __init__(self, console: Console, render: Callable[[], RenderableType], *, enabled: bool,
                 auto_refresh: bool = True, refresh_per_second: float = 10):
        self.console = console
        self.render = render
        self.enabled = enabled  # False: nothing is ever drawn (stderr is not a terminal, or --quiet)
        self.auto_refresh = auto_refresh
        self.refresh_per_second = refresh_per_second
        self._live: Live | None = None

    @property
    def is_started(self) -> bool:
        return self._live is not None

    def start(self) -> None:
        """Draw the area below what the terminal holds now (no-op when disabled or already drawn)."""
        if not self.enabled or self._live is not None:
            return
        self._live = Live(
            console=self.console, get_renderable=self.render, transient=True, auto_refresh=self.auto_refresh,
            refresh_per_second=self.refresh_per_second,
            redirect_stdout=False,  # stdout carries the summaries; never route it through the display
            redirect_stderr=True,  # library warnings written to stderr are printed above the area
        )
        self._live.start(refresh=True)

    def stop(self) -> None:
        """Erase the area, leaving the cursor where its first line was."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def refresh(self) -> None:
        """Redraw now (the area also redraws by itself when ``auto_refresh``)."""
        if self._live is not None:
            self._live.refresh()

    def print(self, *objects, **options) -> None:
        """Print above the area, with the area as it is now under it (not as it was last drawn)."""
        self.refresh()
        self.console.print(*objects, **options)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block the area is off the screen, so that what is written to stdout (which may be
        the same terminal) stays; it is drawn anew below that after."""
        if self._live is None:
            yield
            return
        self.stop()
        try:
            yield
        finally:
            self.start()


class DrawnOnLiveArea:
    """A display drawn on ``self._area`` (a LiveArea): a context manager around the run, and ``paused()``
    around what is written to stdout, which may be the same terminal."""

    _area: LiveArea

    def __enter__(self):
        self._area.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._area.stop()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block the live display is off the screen, so that what is written to stdout stays
        there; it is drawn anew below it after."""
        with self._area.paused():
            yield

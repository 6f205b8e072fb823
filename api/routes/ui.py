"""The dashboard: `GET /ui`, a page of plain HTML and JavaScript (api/ui/) that reads the
REST API every two seconds — sites with their GPUs and agents' health, WAN links with
measured bandwidth and RTT, jobs with state and placement, live loss and WAN-bytes charts
(uPlot), events. uPlot comes from the npm registry at set-up time (scripts/setup.sh puts
it in api/ui/vendor/) and is served from here: the page fetches nothing elsewhere.

The page asks for an API key for the job routes (kept in the browser's localStorage, or
given in the URL's fragment, `/ui#key=…`, which never reaches a server log); sites and
links need none.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parents[1] / "ui"
#: What scripts/setup.sh vendors; without it the page still shows every table.
UPLOT = UI_DIR / "vendor" / "uPlot.iife.min.js"

router = APIRouter(tags=["dashboard"])


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    return HTMLResponse((UI_DIR / "index.html").read_text())


def install(app: FastAPI) -> None:
    """The page at /ui and its scripts, styles and chart library under /ui/static."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=UI_DIR, check_dir=True), name="ui-static")

"""The Feishu sheet archive: one row per alert event, appended in batches by a scheduled flush (not
per notification, so it is not an outbox channel)."""

from __future__ import annotations

import logging

from megatrace.alertbot.channels.base import Context
from megatrace.alertbot.kinds import ArchiveState, Outcome
from megatrace.alertbot.metrics import BotMetrics

log = logging.getLogger(__name__)


def flush_archive(ctx: Context, metrics: BotMetrics) -> int:
    """Append pending archive rows to the Feishu sheet in batches; returns rows appended."""
    sheet = ctx.cfg.feishu.sheet
    if not sheet.spreadsheet_token or ctx.app is None:
        return 0
    appended = 0
    while rows := ctx.store.outbox.pending_archive(sheet.batch_size):
        ids = [r.id for r in rows]
        ctx.store.outbox.set_archive(ids, ArchiveState.SENDING)
        result = ctx.app.append_rows(sheet.spreadsheet_token, sheet.sheet_id, [r.row for r in rows])
        if not result.ok:
            state = ArchiveState.PENDING if result.outcome == Outcome.RETRY else ArchiveState.DEAD
            ctx.store.outbox.set_archive(ids, state, result.detail)
            log.error("sheet archive of %d rows failed (%s): %s", len(ids), state, result.detail)
            return appended
        ctx.store.outbox.set_archive(ids, ArchiveState.SENT)
        metrics.archived.inc(len(ids))
        appended += len(ids)
    return appended

"""Escaping of alert text (labels, annotations, names) for the card field it lands in.

Alertmanager passes on whatever the monitored side wrote into labels and annotations. Pasted into a
card unescaped, a value could mention people (``<at id=all></at>`` pings the whole group), colour or
link text, or break out of the surrounding markup. Each Feishu text kind gets its own function:

- `lark_md`: Feishu's card Markdown. Its markup characters become numeric character references,
  which Feishu shows as the characters themselves and never reads as markup.
- `plain_text`: shown as it is by Feishu; only control characters (other than newline and tab),
  which Feishu rejects or shows as boxes, are dropped.
"""

from __future__ import annotations

import re

LARK_MD_SPECIAL = "&<>*~`[]\\"
_LARK_MD = str.maketrans({c: f"&#{ord(c)};" for c in LARK_MD_SPECIAL})
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def lark_md(text: object) -> str:
    """`text` as lark_md that shows exactly `text`: no mention, tag, link, emphasis or code span."""
    return str(text).translate(_LARK_MD)


def plain_text(text: object) -> str:
    """`text` for a plain_text field: as it is, less control characters."""
    return _CONTROL.sub("", str(text))

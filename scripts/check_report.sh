#!/usr/bin/env bash
# Render a report.html in headless Chromium to a PNG screenshot, to look at it.
#   scripts/check_report.sh report/report.html [screenshot.png] [width] [height]
# Needs chromium (Debian: apt-get install -y chromium). The page is self-contained, so the
# screenshot shows exactly what a reader sees offline. Fails if Chromium cannot render it.
set -euo pipefail
html=${1:?usage: scripts/check_report.sh REPORT_HTML [OUT_PNG] [WIDTH] [HEIGHT]}
out=${2:-${html%.html}.png}
width=${3:-1400}
height=${4:-12000}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [[ -z $browser ]]; then
    echo "check_report: no chromium found (Debian: apt-get install -y chromium)" >&2
    exit 2
fi
# --no-sandbox: Chromium refuses to run as root with its sandbox (containers, CI).
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="$width,$height" --screenshot="$(realpath -m "$out")" \
    "file://$(realpath "$html")" 2>/dev/null
test -s "$out"
echo "screenshot of $html: $out (${width}x${height})"

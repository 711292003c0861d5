#!/bin/sh
# Pre-quantize an upstream Hugging Face MoE repo with expq in CI: on a new upstream commit, convert it at that
# pinned commit, verify it bit for bit against the source, and push it to TARGET_REPO. A no-op (exit 0) when
# TARGET_REPO already holds a conversion of that source commit. See docs/ci.md for the inputs, the steps, the
# JSON it reads and the exit statuses.
#
# Inputs (environment):
#   SRC_REPO       upstream Hub repo id (required), e.g. mistralai/Mixtral-8x7B-v0.1
#   TARGET_REPO    Hub repo id to publish to (required), e.g. me/Mixtral-8x7B-v0.1-experts-int8
#   SRC_REVISION   branch, tag or commit to follow (default main); resolved to a commit sha first, and only that
#                  sha is used from then on
#   TARGET_REVISION  branch of TARGET_REPO to push to and to compare against (default: main)
#   WORK           work directory (default ./expq-work): OUT is $WORK/out/<sha>-<format>, the steps' JSON in $WORK
#   HF_TOKEN       Hub token with write access to TARGET_REPO (read access to SRC_REPO if gated); never printed
#   EXPQ_FORMAT    auto | compressed-tensors | experts-int8 (default auto)
#   EXPQ_DEVICE    auto | cpu | cuda | cuda:0,cuda:1,... (default auto; verify uses the first device listed)
#   EXPQ_PRIVATE   1: create TARGET_REPO private
#   EXPQ_FORCE     1: push even when TARGET_REPO already holds this source commit
#   EXPQ, PYTHON   the expq command (default expq) and the python that has expq installed (default python3)
#
# Exit status: 0 pushed, or nothing to do; otherwise the failing step's expq status (docs/ci.md), which the script
# also writes, with the step's name, to $WORK/result.json (and to $GITHUB_OUTPUT when set).
set -eu

usage() { echo "prequantize.sh: $1" >&2; exit 2; }
[ -n "${SRC_REPO:-}" ] || usage "set SRC_REPO (the upstream Hub repo id)"
[ -n "${TARGET_REPO:-}" ] || usage "set TARGET_REPO (the Hub repo id to publish to)"
SRC_REVISION=${SRC_REVISION:-main}
TARGET_REVISION=${TARGET_REVISION:-}
WORK=${WORK:-$PWD/expq-work}
EXPQ_FORMAT=${EXPQ_FORMAT:-auto}
EXPQ_DEVICE=${EXPQ_DEVICE:-auto}
EXPQ=${EXPQ:-expq}
PYTHON=${PYTHON:-python3}
export SRC_REPO TARGET_REPO SRC_REVISION TARGET_REVISION EXPQ_FORMAT
mkdir -p "$WORK"
RESULT=$WORK/result.json
rm -f "$RESULT" "$WORK/commit" "$WORK/published" "$WORK/convert.json" "$WORK/verify.json" "$WORK/push.json"

# finish STEP STATUS [PUSHED]: record the outcome ($WORK/result.json, $GITHUB_OUTPUT) and exit with STATUS.
finish() {
  STEP=$1 STATUS=$2 PUSHED=${3:-false} SHA=${SHA:-} OUT=${OUT:-}
  export STEP STATUS PUSHED SHA OUT WORK
  "$PYTHON" - <<'PY' || true
import json, os
w = os.environ["WORK"]
def load(name):
    try:
        with open(os.path.join(w, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
push = load("push.json") or {}
r = {"step": os.environ["STEP"], "exit": int(os.environ["STATUS"]), "pushed": os.environ["PUSHED"] == "true",
     "source": os.environ["SRC_REPO"], "commit": os.environ["SHA"] or None, "target": os.environ["TARGET_REPO"],
     "out": os.environ["OUT"] or None, "commit_url": push.get("commit_url") if os.environ["PUSHED"] == "true" else None}
with open(os.path.join(w, "result.json"), "w") as f:
    json.dump(r, f)
gh = os.environ.get("GITHUB_OUTPUT")
if gh:
    with open(gh, "a") as f:
        for k in ("step", "exit", "pushed", "commit", "commit_url"):
            v = r[k]
            f.write(f"{k}={str(v).lower() if isinstance(v, bool) else ('' if v is None else v)}\n")
PY
  if [ "$STATUS" -ne 0 ]; then
    echo "prequantize.sh: step '$1' failed with exit status $STATUS (docs/ci.md, exit statuses)" >&2
  fi
  exit "$STATUS"
}

# json FILE KEY: one top-level value of a --json output (true/false lower case, null as empty).
json() {
  "$PYTHON" -c 'import json, sys
v = json.load(open(sys.argv[1]))[sys.argv[2]]
print("" if v is None else str(v).lower() if isinstance(v, bool) else v)' "$1" "$2"
}

# 1. The upstream commit to convert: SRC_REVISION resolved once; everything below uses only the sha.
rc=0
"$PYTHON" - >"$WORK/commit" <<'PY' || rc=$?
import os, sys
from huggingface_hub import HfApi
repo, rev = os.environ["SRC_REPO"], os.environ["SRC_REVISION"]
try:
    print(HfApi().model_info(repo, revision=rev).sha)
except Exception as e:  # the same classification, message and exit status as expq convert
    from expq.errors import ExpqError
    from expq.hub.errors import translate
    err = e if isinstance(e, ExpqError) else translate(e, repo=repo, revision=rev)
    if not isinstance(err, ExpqError):
        raise err
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)
PY
[ "$rc" -eq 0 ] || finish resolve "$rc"
SHA=$(cat "$WORK/commit")
echo "prequantize.sh: $SRC_REPO $SRC_REVISION is $SHA" >&2
OUT=$WORK/out/$SHA-$EXPQ_FORMAT

# 2. Already published? TARGET_REPO's expq.json names the source repo and commit it was converted from.
rc=0
SHA=$SHA "$PYTHON" - >"$WORK/published" <<'PY' || rc=$?
import json, os, sys
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
repo, rev = os.environ["TARGET_REPO"], os.environ["TARGET_REVISION"] or None
try:
    m = json.load(open(hf_hub_download(repo, "expq.json", revision=rev)))
except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
    print("no"); sys.exit(0)
except Exception as e:
    from expq.errors import ExpqError
    from expq.hub.errors import translate
    err = translate(e, repo=repo, revision=rev or "main")
    if not isinstance(err, ExpqError):
        raise err
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)
src, fmt = m.get("source") or {}, os.environ["EXPQ_FORMAT"]
same = (src.get("repo_id") == os.environ["SRC_REPO"] and src.get("commit") == os.environ["SHA"]
        and (fmt == "auto" or m.get("format") == fmt))
print("yes" if same else "no")
PY
[ "$rc" -eq 0 ] || finish check-target "$rc"
PUBLISHED=$(cat "$WORK/published")
if [ "$PUBLISHED" = yes ] && [ "${EXPQ_FORCE:-0}" != 1 ]; then
  echo "prequantize.sh: $TARGET_REPO already holds $SRC_REPO@$SHA: nothing to do" >&2
  finish up-to-date 0
fi

# 3. Convert at the pinned commit (a quick no-op when OUT already holds this conversion, e.g. from the CI cache).
rc=0
"$EXPQ" convert "$SRC_REPO" "$OUT" --revision "$SHA" --format "$EXPQ_FORMAT" --device "$EXPQ_DEVICE" --json \
  >"$WORK/convert.json" || rc=$?
[ "$rc" -eq 0 ] || finish convert "$rc"
[ "$(json "$WORK/convert.json" commit)" = "$SHA" ] || { echo "converted commit is not $SHA" >&2; finish convert 1; }
echo "prequantize.sh: convert done (up_to_date: $(json "$WORK/convert.json" up_to_date))" >&2

# 4. Verify bit for bit against the source at the same commit (exit 1: a check failed).
rc=0
"$EXPQ" verify "$OUT" --source "$SRC_REPO" --revision "$SHA" --device "${EXPQ_DEVICE%%,*}" --json \
  >"$WORK/verify.json" || rc=$?
if [ "$rc" -ne 0 ]; then
  [ -s "$WORK/verify.json" ] && echo "prequantize.sh: $(json "$WORK/verify.json" verdict)" >&2
  finish verify "$rc"
fi

# 5. Push (verify again without the source: every file against expq.json's sha256; resumable upload). The model
# card push writes into OUT as README.md is kept by later `expq convert` runs, which stay no-ops.
set -- --commit-message "expq: $SRC_REPO@$SHA ($EXPQ_FORMAT)"
[ -z "$TARGET_REVISION" ] || set -- "$@" --revision "$TARGET_REVISION"
[ "${EXPQ_PRIVATE:-0}" != 1 ] || set -- "$@" --private
rc=0
"$EXPQ" push "$OUT" "$TARGET_REPO" --json "$@" >"$WORK/push.json" || rc=$?
[ "$rc" -eq 0 ] || finish push "$rc"
echo "prequantize.sh: pushed $(json "$WORK/push.json" checked_remote) files to $TARGET_REPO" >&2
finish push 0 true

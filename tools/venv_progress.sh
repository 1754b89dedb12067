# Sourced by tools/make_*_venv.sh: a venv build says where it is, a line per stage and a line
# per package pip fetches, each with the seconds since the build began (a build is minutes of
# downloads and unpacking on 2 cores, and `pip -q` said nothing meanwhile).
# STAGE_NAME: the make target, at the start of each line.

# stage TEXT...: one line, "make NAME [  12 s] TEXT".
stage() { printf 'make %s [%4d s] %s\n' "$STAGE_NAME" "$SECONDS" "$*"; }

# pip_install PYTHON ARGS...: pip install ARGS, saying each package as pip collects it
# ("  12: torch==2.13.0"), then how many it installs. On a failure, pip's last 40 lines of
# output follow.
pip_install() {
    local python=$1 log
    shift
    log=$(mktemp)
    if ! "$python" -m pip install --progress-bar off "$@" 2>&1 | tee "$log" | _say_packages; then
        tail -n 40 "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

_say_packages() {
    local n=0 line commas
    while IFS= read -r line; do
        case $line in
            Collecting\ *)
                n=$((n + 1))
                line=${line#Collecting }
                stage "  $n: ${line%% (from *}"
                ;;
            Installing\ collected\ packages:*)
                line=${line#*: }
                commas=${line//[^,]/}
                stage "  installing $((${#commas} + 1)) packages"
                ;;
        esac
    done
}

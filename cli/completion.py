"""Shell completion for `phalanx`: `phalanx completion bash` / `phalanx completion zsh` print a script.

The script is made from the CLI's own parser, so it offers exactly the commands and options this version
has. Node arguments complete from `phalanx nodes -o name`, job arguments from `phalanx jobs -o name` (asked
when TAB is pressed, with the same controller flags and environment); files where a command takes a file.

    source <(phalanx completion bash)                 # or save it in /etc/bash_completion.d/phalanx
    phalanx completion zsh > "${fpath[1]}/_phalanx"   # zsh (through bashcompinit)
"""

from __future__ import annotations

import argparse

GLOBAL_WITH_VALUE = ("--controller", "--ca", "--cert", "--key")
FILE_OPTIONS = {"--ca", "--cert", "--key", "--plot", "--replay", "--checkpoint-dir", "--dir", "--agent-config"}
NODE_DESTS = {"node", "nodes", "member"}
JOB_DESTS = {"job"}
FILE_DESTS = {"scenario"}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _describe(parser: argparse.ArgumentParser) -> tuple[list[str], list[str], str, dict[str, list[str]]]:
    """(options, options taking a value, what its positional is, {option: its choices})."""
    options, valued, positional, choices = [], [], "", {}
    for action in parser._actions:
        if action.option_strings:
            options += [o for o in action.option_strings if o.startswith("--") or len(o) == 2]
            if action.nargs != 0 and not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                valued += action.option_strings
                if action.choices:
                    for o in action.option_strings:
                        choices[o] = [str(c) for c in action.choices]
        elif not isinstance(action, argparse._SubParsersAction) and not positional:
            positional = "node" if action.dest in NODE_DESTS else "job" if action.dest in JOB_DESTS else \
                "file" if action.dest in FILE_DESTS else ""
    return options, valued, positional, choices


def _words(items) -> str:
    return " ".join(sorted(set(items)))


def bash(parser: argparse.ArgumentParser, prog: str = "phalanx") -> str:
    commands = _subcommands(parser)
    top_options, _, _, _ = _describe(parser)
    cases, nested = [], []
    for name, sub in commands.items():
        children = _subcommands(sub)
        targets = [(name, sub)] if not children else [(f"{name} {child}", p) for child, p in children.items()]
        if children:
            nested.append(f'    {name}) subs="{_words(children)}" ;;')
            cases.append(f'    "{name}") COMPREPLY=($(compgen -W "{_words(children)}" -- "$cur")) ;;')
        for key, p in targets:
            options, valued, positional, choices = _describe(p)
            values = "".join(f'        {o}) COMPREPLY=($(compgen -W "{_words(c)}" -- "$cur")); return ;;\n'
                             for o, c in choices.items())
            files = [o for o in valued if o in FILE_OPTIONS]
            if files:
                values += f'        {"|".join(files)}) COMPREPLY=($(compgen -f -- "$cur")); return ;;\n'
            others = [o for o in valued if o not in choices and o not in FILE_OPTIONS]
            if others:
                values += f'        {"|".join(others)}) return ;;\n'
            fill = {"node": '_phalanx_names nodes', "job": '_phalanx_names jobs',
                    "file": 'COMPREPLY=($(compgen -f -- "$cur"))'}.get(positional, "")
            cases.append(f'    "{key}")\n      case "$prev" in\n{values}      esac\n'
                         f'      if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "{_words(options)}" -- "$cur"))\n'
                         f'      else {fill or ":"}; fi ;;')
    return f"""# bash completion for {prog} (`{prog} completion bash`), made from its parser
_phalanx_names() {{
  # the names `{prog} nodes|jobs -o name` lists, with the controller flags typed so far
  local flags=() i
  for ((i = 1; i < ${{#COMP_WORDS[@]}} - 1; i++)); do
    case "${{COMP_WORDS[i]}}" in
      {"|".join(GLOBAL_WITH_VALUE)}) flags+=("${{COMP_WORDS[i]}}" "${{COMP_WORDS[i + 1]}}") ;;
      --insecure) flags+=(--insecure) ;;
    esac
  done
  COMPREPLY=($(compgen -W "$({prog} "${{flags[@]}}" "$1" -o name 2>/dev/null)" -- "$cur"))
}}

_phalanx() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD - 1]}}"
  local cmd="" sub="" subs="" i w
  for ((i = 1; i < COMP_CWORD; i++)); do
    w="${{COMP_WORDS[i]}}"
    case "$w" in
      {"|".join(GLOBAL_WITH_VALUE)}) ((i++)); continue ;;
      -*) continue ;;
    esac
    if [[ -z "$cmd" ]]; then
      cmd="$w"
      case "$cmd" in
{chr(10).join(nested)}
      esac
    elif [[ -z "$sub" && " $subs " == *" $w "* ]]; then
      sub="$w"
    fi
  done
  case "$prev" in
    --ca|--cert|--key) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    --controller) return ;;
  esac
  if [[ -z "$cmd" ]]; then
    COMPREPLY=($(compgen -W "{_words(commands)} {_words(top_options)}" -- "$cur"))
    return
  fi
  local key="$cmd"
  [[ -n "$sub" ]] && key="$cmd $sub"
  case "$key" in
{chr(10).join(cases)}
  esac
}}
complete -o default -F _phalanx {prog}
"""


def zsh(parser: argparse.ArgumentParser, prog: str = "phalanx") -> str:
    return (f"#compdef {prog}\n# zsh completion for {prog} (`{prog} completion zsh`): the bash one, through "
            "bashcompinit\nautoload -U +X bashcompinit && bashcompinit\n" + bash(parser, prog))

"""The command line, `fl-lightning COMMAND [--group.field value ...]`, in four layers, each importing
only those before it: `messages` (parse errors restated as one line naming the field), `arguments`
(the command line rewritten and checked before parsing: short names, bare flags, config files,
class paths), `parser` (jsonargparse's parser of some commands, and the one parse function) and
`main` (the commands and the entry point). This package imports none of them, so a command may use
the parser without importing the others."""

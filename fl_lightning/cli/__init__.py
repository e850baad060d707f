"""The command line's parsing, `fl-lightning COMMAND [--group.field value ...]`: `messages` (parse
errors restated as one line naming the field), `arguments` (the command line rewritten and checked
before parsing: short names, bare flags, config files, class paths) and `parser` (jsonargparse's
parser of some commands, and the one parse function), each importing only those before it. The
commands themselves, which experiments' commands build on this, are `fl_lightning.commands`. This
package imports none of its modules, so a command may use the parser without importing the others."""

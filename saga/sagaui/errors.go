package sagaui

import "errors"

// ErrInvalidConfig is returned when New is given a Config it cannot serve
// (no Client, a Prefix that is not a clean path); the error says what is
// wrong.
var ErrInvalidConfig = errors.New("sagaui: invalid config")

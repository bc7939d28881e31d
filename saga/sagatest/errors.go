package sagatest

import "errors"

// ErrInjectedCrash is returned by an attempt the Injector crashes before
// its commit: the attempt fails with it, and is delivered again.
var ErrInjectedCrash = errors.New("sagatest: injected crash before commit")

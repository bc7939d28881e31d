// Package readme holds the test that runs the README's program as a user
// would: in a module of its own, outside the repository, depending on
// pgsaga through a replace line.
package readme

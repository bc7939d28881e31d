package testnats

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A private server whose port another server took between the test's pick
// and its start is told apart from that other server (which answers on the
// port): start says the port is taken, and Private tries another. Without
// the server's name, the other server would be taken for the test's own.
func TestPrivateServerOnATakenPort(t *testing.T) {
	first := Private(t)
	for name, dir := range map[string]string{"another directory": t.TempDir(), "the same directory": first.dir} {
		t.Run(name, func(t *testing.T) {
			s := &Server{t: t, port: first.port, dir: dir, name: fmt.Sprintf("pgsaga-test-%d-late", os.Getpid())}
			err := s.start()
			s.Kill()
			require.ErrorIs(t, err, errPortTaken)
			got, err := check(first.URL())
			require.NoError(t, err, "the first server still answers")
			assert.Equal(t, first.name, got)
		})
	}
	second := Private(t)
	assert.NotEqual(t, first.port, second.port)
}

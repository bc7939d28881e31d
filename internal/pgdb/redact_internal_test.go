package pgdb

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// pgx is the judge: a password the split missed is caught by pgx reading
// the masked string, and a password pgx would take from the environment is
// not mistaken for one.
func TestMissedPassword(t *testing.T) {
	t.Setenv("PGPASSWORD", "from-env")
	for s, want := range map[string]bool{
		"host=h password=s3cr3t":                 true,
		"host=h password=xxxxx":                  false,
		"host=h":                                 false,
		"host=h password=xxxxx password='again'": true,
		"postgres://u:s3cr3t@h/db":               true,
		"postgres://u:xxxxx@h/db":                false,
		"postgres://u@h/db":                      false,
		"postgres://h/db?password=s3cr3t":        true,
		"postgres://u:xxxxx@h/db?password=s3":    true,
		"postgres://u:xxxxx@h/db?password=xxxxx": false,
	} {
		assert.Equal(t, want, missedPassword(s), s)
	}
}

package pgdb_test

import (
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgsaga/pgsaga/internal/pgdb"
)

// BenchmarkEncodeUUID encodes one uuid argument as pgx does for a
// statement's parameter: through driver.Valuer (pgx's default for
// google/uuid) and with the pools' EncodeUUIDs.
func BenchmarkEncodeUUID(b *testing.B) {
	id := uuid.New()
	for name, m := range map[string]*pgtype.Map{
		"driver.Valuer": pgtype.NewMap(),
		"EncodeUUIDs":   func() *pgtype.Map { m := pgtype.NewMap(); pgdb.EncodeUUIDs(m); return m }(),
	} {
		b.Run(name, func(b *testing.B) {
			buf := make([]byte, 0, 64)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := m.Encode(pgtype.UUIDOID, pgtype.BinaryFormatCode, id, buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

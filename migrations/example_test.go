package migrations_test

import (
	"context"
	"fmt"
	"io/fs"
	"log"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/migrations"
)

// Bring the schema up to date when your program starts, before anything
// uses the database, and refuse a database a newer release has migrated.
// Every process may do it at once: they take turns, and only the first
// finds anything to apply.
func ExampleApply() {
	ctx := context.Background()
	db := testdb.ForExample().SQL // your *sql.DB over pgx

	applied, err := migrations.Apply(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	current, known, err := migrations.Version(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	if current > known {
		log.Fatalf("the schema is at version %d; this release knows up to %d: upgrade the program", current, known)
	}
	// The example's database was migrated already, so nothing was pending;
	// on a new database applied lists every version.
	fmt.Println("applied now:", len(applied))
	fmt.Println("schema current:", current == known)
	// Output:
	// applied now: 0
	// schema current: true
}

// The migrations are embedded in the binary: read them to review the
// schema, or to diff it between releases.
func ExampleFS() {
	names, err := fs.Glob(migrations.FS(), "*.sql")
	if err != nil {
		log.Fatal(err)
	}
	for _, name := range names[:3] {
		fmt.Println(name)
	}
	// Output:
	// 00001_idempotency_keys.sql
	// 00002_domain_events.sql
	// 00003_orders.sql
}

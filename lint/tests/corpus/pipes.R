# Pipes.
library(magrittr)
a <- x %>% f() %>% g()
b <- x %>%
  f() %>%
  g()
c1 <- x %>%
  f() %>% g()
d <- x %>% f() %>%
  g()
e <- x |>
  f()
h <- x %>%
  f(y %>% g()) %>%
  k()
